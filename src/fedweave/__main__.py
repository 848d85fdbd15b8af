"""``python -m fedweave``: the ``fedweave`` command (:func:`fedweave.cli.main`), for an environment whose scripts
folder is not on ``PATH``."""

from fedweave.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
