"""``python -m train.search``: searching a video store from the command line, which lives in the search package
(`testa_search.cli.search`, whose docstring says what it does); kept here beside `train.index`."""

import sys

from testa_search.cli.search import main


if __name__ == "__main__":
    main(sys.argv[1:])
