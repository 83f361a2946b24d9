"""python -m kvpage.distributed SPEC_JSON: a tensor-parallel worker process (started by launcher.py)."""
import os
import sys

from kvpage.distributed.worker import main

code = main()
# After a clean shutdown there is nothing left to save: skip the interpreter's teardown of torch and
# transformers (seconds), which the driver would otherwise wait out in LLM.shutdown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
