"""What the exported runtimes do to their graphs, as pure functions of the graph: which matrix multiplies int8 leaves
in fp32, and the rewrites of an OpenVINO model (two linear layers folded into one, linear layers made bf16).

The selections read a graph as ``name -> (op type, names of the nodes producing its inputs)`` (`openvino_nodes`,
`onnx_nodes`) and pick nodes by what they compute, never by their names: the matrix multiplies whose results decide
the matching (`matching_matmuls`: the key similarities, and Eq. 1's attention for the importance strategy), the
projections that compute the matching's keys (`key_projection_matmuls`), the temporal attention's output branch (its
projection and ``temporal_fc``: `attention_output_matmuls`, whose int8 error flipped merge decisions on repeated
frames) and the attention's own products (`attention_product_matmuls`). docs/inference.md, "Agreement between
runtimes", has the measurements behind each choice.
"""

from collections import deque
from typing import Any, Callable, Iterable


def matching_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                     sort_types: tuple[str, ...] = ("TopK",)) -> list[str]:
    """The matrix multiplies whose results feed a sort without passing another matrix multiply: the key similarity
    scores (and Eq. 1's attention for the importance strategy). Walking up from every sort, each path stops at the
    first matrix multiply, so the projections that compute the keys (one multiply further up) are not included.

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)``.
    """
    return first_matmuls_above(nodes, [name for name, (kind, _) in nodes.items() if kind in sort_types], matmul_types)


def key_projection_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",)
                           ) -> list[str]:
    """The matrix multiplies that compute the matching's keys: walking up from the inputs of every
    `matching_matmuls` product, each path stops at the first matrix multiply (the attentions' query-key-value
    projections). ONNX Runtime's int8 keeps them in fp32 (`OnnxRuntimeRuntime.quantize`): without SmoothQuant its
    per-tensor activation scale moved the demo's merge decisions (three videos below cosine 0.99)."""
    starts = [i for name in matching_matmuls(nodes, matmul_types) for i in nodes[name][1] if i in nodes]
    return first_matmuls_above(nodes, starts, matmul_types)


def first_matmuls_above(nodes: dict[str, tuple[str, list[str]]], starts: Iterable[str],
                        matmul_types: tuple[str, ...] = ("MatMul",)) -> list[str]:
    """The first matrix multiply on every path up from ``starts`` (a start that is one is its own)."""
    found = set()

    def upwards(name: str) -> Iterable[str]:
        kind, inputs = nodes[name]
        if kind in matmul_types:
            found.add(name)
            return ()
        return (i for i in inputs if i in nodes)

    walk_graph(starts, upwards)
    return sorted(found)


def walk_graph(starts: Iterable[str], visit: Callable[[str], Iterable[str]]) -> None:
    """Breadth-first over node names from ``starts``: ``visit(name)`` runs once per node and returns where to go
    next."""
    seen, queue = set(), deque(starts)
    while queue:
        name = queue.popleft()
        if name not in seen:
            seen.add(name)
            queue.extend(visit(name))


def fed_by(nodes: dict[str, tuple[str, list[str]]], name: str, kinds: tuple[str, ...]) -> bool:
    """Whether node ``name`` has an input produced by a node of one of ``kinds``."""
    return any(nodes.get(i, ("",))[0] in kinds for i in nodes[name][1])


def attention_output_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                             attention_types: tuple[str, ...] = ("ScaledDotProductAttention",),
                             shape_types: tuple[str, ...] = ("ShapeOf", "Shape"), min_chain: int = 1) -> list[str]:
    """The matrix multiplies between an attention and its residual add: the attention's output projection and, in a
    divided block's temporal branch, ``temporal_fc`` after it. With ``min_chain=2`` only the chains of two or more
    (the temporal branches): the layers whose int8 error flipped merge decisions on the demo's videos.

    Why those: on repeated or near-repeated frames, the temporal attention's output carries the small differences
    between frames that the later blocks' frame matching decides on, and one per-tensor int8 scale for its
    activations rounds them away. Keeping the temporal branch in fp32 fixed the demo's two videos whose embeddings
    had moved (cosine 0.98); the spatial projections or every other layer group in fp32 did not (docs/inference.md,
    "Agreement between runtimes").

    An attention is a fused attention node (``attention_types``) or a matrix multiply fed by a ``Softmax`` (the
    attention probabilities times the values, as an unfused export has it). From each, the walk goes down through
    every consumer and stops at the residual add (an ``Add`` of two computed tensors; a bias add has a constant or
    initializer input) and at shape reads. Selected by what the nodes compute, not by their names.

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)`` (`openvino_nodes`, `onnx_nodes`).
    """
    consumers: dict[str, list[str]] = {name: [] for name in nodes}
    for name, (_, inputs) in nodes.items():
        for producer in inputs:
            if producer in consumers:
                consumers[producer].append(name)

    def computed(name: str) -> bool:
        return name in nodes and nodes[name][0] != "Constant"

    def is_attention(name: str) -> bool:
        kind = nodes[name][0]
        return kind in attention_types or (kind in matmul_types and fed_by(nodes, name, ("Softmax",)))

    def chain(attention: str) -> set[str]:
        found = set()

        def downwards(name: str) -> Iterable[str]:
            kind, inputs = nodes[name]
            if kind in shape_types or (kind == "Add" and sum(map(computed, inputs)) >= 2):
                return ()
            if kind in matmul_types:
                found.add(name)
            return consumers[name]

        walk_graph(consumers[attention], downwards)
        return found

    chains = [chain(name) for name in nodes if is_attention(name)]
    return sorted(set().union(*[c for c in chains if len(c) >= min_chain]))


FOLDED_SUFFIX = "/testa_folded"
"""The end of the friendly name of a linear layer that `fold_linear_pairs` made of two."""


def _linear_parts(node: Any) -> tuple[Any, Any] | None:
    """``(weight (out, in) float64, the input)`` of a matrix multiply by a constant fp32 weight, else None."""
    import numpy as np

    if node.get_type_name() != "MatMul" or node.get_attributes()["transpose_a"]:
        return None
    weight = node.input_value(1).get_node()
    if weight.get_type_name() != "Constant" or weight.get_output_element_type(0).get_type_name() != "f32":
        return None
    matrix = np.asarray(weight.get_data(), dtype=np.float64)
    if matrix.ndim != 2:
        return None
    return (matrix if node.get_attributes()["transpose_b"] else matrix.T), node.input_value(0)


def _only_consumer(node: Any) -> Any | None:
    targets = list(node.output(0).get_target_inputs())
    return targets[0].get_node() if len(targets) == 1 else None


def _constant_bias(node: Any) -> Any | None:
    """The constant vector an ``Add`` adds (a linear layer's bias), else None."""
    import numpy as np

    if node is None or node.get_type_name() != "Add":
        return None
    constants = [node.input_value(i).get_node() for i in range(2)
                 if node.input_value(i).get_node().get_type_name() == "Constant"]
    return np.asarray(constants[0].get_data(), dtype=np.float64).reshape(-1) if len(constants) == 1 else None


def fold_linear_pairs(model: Any, names: Iterable[str]) -> list[str]:
    """Folds, in an OpenVINO model, every pair of linear layers among ``names`` whose first feeds only the second
    (through its bias at most) into one layer: ``(x W1^T + b1) W2^T = x (W2 W1)^T + W2 b1``, the products computed in
    float64 and stored in fp32. The second layer's bias stays where it is. Returns the names of the layers of
    ``names`` the model has now: the folded ones (the first layer's name and `FOLDED_SUFFIX`) and those left alone.

    Why: at inference the temporal attention's projection feeds ``temporal_fc`` directly, two linear maps in a row.
    int8 keeps that branch out of quantization (`attention_output_matmuls`), and as one layer it costs half as much
    (docs/inference.md, "Speed of the exported encoders")."""
    from openvino import opset13 as ops

    names = set(names)
    by_name = {node.get_friendly_name(): node for node in model.get_ops()}
    remaining = set(names)
    for name in sorted(names):
        first = by_name[name]
        first_parts = _linear_parts(first)
        after = _only_consumer(first)
        bias = _constant_bias(after)
        second = _only_consumer(after) if bias is not None else after
        second_parts = _linear_parts(second) if second is not None else None
        if first_parts is None or second_parts is None or second.get_friendly_name() not in names:
            continue
        if bias is not None and bias.shape[0] != first_parts[0].shape[0]:  # not one bias per output
            continue
        (w1, x), (w2, _) = first_parts, second_parts
        folded = ops.matmul(x, ops.constant((w2 @ w1).astype("float32")), False, True)
        folded.set_friendly_name(name + FOLDED_SUFFIX)
        output = folded if bias is None else ops.add(folded, ops.constant((w2 @ bias).astype("float32")))
        for target in list(second.output(0).get_target_inputs()):
            target.replace_source_output(output.output(0))
        remaining -= {name, second.get_friendly_name()}
        remaining.add(name + FOLDED_SUFFIX)
    model.validate_nodes_and_infer_types()
    return sorted(remaining)


def attention_product_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                               softmax_types: tuple[str, ...] = ("Softmax",)) -> list[str]:
    """The attention's own matrix products in an unfused graph: queries times keys (the first matrix multiply above
    each ``Softmax``, as `matching_matmuls` walks up from a sort) and the probabilities times the values (a matrix
    multiply fed by a ``Softmax``). NNCF leaves these to OpenVINO's fused attention in fp32; ONNX Runtime's static
    QDQ quantization gives both operands one int8 scale per tensor (`OnnxRuntimeRuntime.quantize` keeps them in
    fp32).

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)`` (`onnx_nodes`).
    """
    scores = matching_matmuls(nodes, matmul_types=matmul_types, sort_types=softmax_types)
    weighted = [name for name, (kind, _) in nodes.items() if kind in matmul_types and fed_by(nodes, name, softmax_types)]
    return sorted(set(scores) | set(weighted))


def openvino_nodes(model: Any) -> dict[str, tuple[str, list[str]]]:
    """`matching_matmuls`' view of an OpenVINO model (by friendly name)."""
    return {op.get_friendly_name(): (op.get_type_name(), [i.get_source_output().get_node().get_friendly_name()
                                                          for i in op.inputs()]) for op in model.get_ops()}


def onnx_nodes(graph: Any) -> dict[str, tuple[str, list[str]]]:
    """`matching_matmuls`' view of an ONNX graph (by node name)."""
    producer = {output: node.name for node in graph.node for output in node.output}
    return {node.name: (node.op_type, [producer[i] for i in node.input if i in producer]) for node in graph.node}


def linear_layers_in_bf16(model: Any, selected: Callable[[str], bool] | None = None) -> int:
    """Makes every matrix multiply by a constant weight (the encoder's linear layers; with ``selected``, those whose
    friendly name it accepts) compute in bf16 inside an
    OpenVINO model: its input and weight are converted to bf16 and its output back to fp32, so the CPU plugin, compiled
    with the f32 hint, runs these layers with bf16 kernels and everything else (LayerNorms, residuals, attention,
    the matching's similarities and rounding, the merge) in fp32, as PyTorch's bf16 (`linear_layers.Bf16Linear`)
    does. Returns how many layers were converted.

    Why not the plugin's bf16 hint: it also runs the key normalisation, the similarity products and the score
    rounding in bf16 (fused into one bf16 MatMul with the rounding as a post-op), so no merge decision matched
    fp32's on the demo's videos. Marking those nodes to stay fp32 (the ``DisablePrecisionConversion`` runtime
    attribute, which Python can only set through the IR's ``rt_info``) kept the nodes the plugin keeps, but its fusions
    build new nodes without the mark; docs/inference.md, "Agreement between runtimes", has the numbers."""
    from openvino import opset13 as ops

    converted = 0
    for node in list(model.get_ordered_ops()):
        weight = node.input_value(1) if node.get_type_name() == "MatMul" else None
        if weight is None or weight.get_node().get_type_name() != "Constant":
            continue
        if selected is not None and not selected(node.get_friendly_name()):
            continue
        attributes = node.get_attributes()
        product = ops.matmul(ops.convert(node.input_value(0), "bf16"), ops.convert(weight, "bf16"),
                             attributes["transpose_a"], attributes["transpose_b"])
        product.set_friendly_name(node.get_friendly_name())
        output = ops.convert(product, node.get_output_element_type(0))
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(output.output(0))
        converted += 1
    model.validate_nodes_and_infer_types()
    return converted



__all__ = ["FOLDED_SUFFIX", "attention_output_matmuls", "attention_product_matmuls", "fed_by", "first_matmuls_above",
           "fold_linear_pairs", "key_projection_matmuls", "linear_layers_in_bf16", "matching_matmuls", "onnx_nodes",
           "openvino_nodes", "walk_graph"]
