import sys

from producer.cli import main

# The guard matters: the planner's tokenising processes are started with multiprocessing's
# "spawn", which imports this module again in each of them (as __mp_main__).
if __name__ == "__main__":
    sys.exit(main())
