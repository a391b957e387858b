"""`python -m loadtest`: see loadtest/cli.py or `python -m loadtest --help`."""
import sys

from loadtest.cli import main

if __name__ == "__main__":
    sys.exit(main())
