"""Test helper: print the argv it received (after the script name) as JSON, touching nothing else."""

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}))
