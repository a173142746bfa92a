"""A torchrun worker that records its pid and then waits: what the tests of ending a lab cell stop."""

import os
import sys
import time

if __name__ == "__main__":
    folder = os.environ["COURSE_TEST_PIDS"]
    with open(os.path.join(folder, f"worker-{os.getpid()}"), "w") as f:
        f.write(str(os.getppid()))  # torchrun's pid
    print("worker started", flush=True)
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
