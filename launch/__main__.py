"""`python -m launch [flags]`: the whole stack (launch/stack.py says what it runs and how)."""
import sys

from process_life.flag_errors import main_refusing
from launch.stack import main

if __name__ == "__main__":
    sys.exit(main_refusing(main))
