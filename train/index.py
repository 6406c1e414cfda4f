"""``python -m train.index`` / ``accelerate launch -m train.index``: the index build's command line, which lives in
the search package (`testa_search.cli.index`, whose docstring says what it does); kept here as the training
scripts' sibling entry point."""

import sys

from testa_search.cli.index import main


if __name__ == "__main__":
    main(sys.argv[1:])
