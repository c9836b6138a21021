"""kiln's echo contract written mosec's way, for scripts/bench-python-servers:
POST /inference {"INPUT0": [16 uint32]} -> {"OUTPUT0": INPUT0 + 1}, one Worker
process with mosec's dynamic batching (max batch 64, as echo_python's config.pbtxt;
max_wait_time 1 ms, the least mosec takes: 0 means its 10 ms default).
Run with the mosec virtualenv (scripts/setup-mosec): python bench-mosec-echo.py --port N
"""

import numpy as np
from mosec import Server, Worker


class Echo(Worker):
    def forward(self, data: list) -> list:
        # The batch arrives as a list of decoded JSON requests; one numpy add for all.
        x = np.array([d["INPUT0"] for d in data], dtype=np.uint32)
        y = x + np.uint32(1)
        return [{"OUTPUT0": row} for row in y.tolist()]


if __name__ == "__main__":
    server = Server()
    server.append_worker(Echo, num=1, max_batch_size=64, max_wait_time=1)
    server.run()
