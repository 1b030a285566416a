"""The fuzz properties of tests/test_fuzz.py with a long budget (CI runs 40 examples each).

    python -m bench.fuzz --examples 20000

Feeds random mutations of a valid data file to the reader and of a valid checkpoint to
``SlideClassifier.load``; any answer other than a clean ``DataFormatError``/``CheckpointError``
or a correct result fails, and hypothesis prints the smallest input that does it.
"""
import argparse
import os
import subprocess
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=20_000, help="examples per property")
    args = p.parse_args(argv)
    env = {**os.environ, "SLIDE_FUZZ_EXAMPLES": str(args.examples)}
    return subprocess.call([sys.executable, "-m", "pytest", "tests/test_fuzz.py", "-q",
                            "-p", "no:cacheprovider"], env=env)


if __name__ == "__main__":
    sys.exit(main())
