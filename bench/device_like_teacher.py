"""A real teacher server whose every forward also takes FORWARD_S_PER_KTOKEN seconds per 1,000
tokens of wall time without using the CPU, as a teacher on a GPU does (its host thread waits
while the device computes). Everything else is `python -m teacher_server`.

    ServerProcess(..., module="bench.device_like_teacher", env=child_env(FORWARD_S_PER_KTOKEN="0.5"))

For benches of the student's side on a CPU machine with fewer free cores than the teachers and the
student need (bench/several_teachers.py): the teachers' time then does not come out of the cores
the student and the other teachers share, as it would not on GPUs.
"""

from __future__ import annotations

import os
import sys
import time

from teacher_server import model_runner
from teacher_server.__main__ import main

S_PER_KTOKEN = float(os.environ.get("FORWARD_S_PER_KTOKEN", "0"))
_forward = model_runner.ModelRunner.forward


def forward(self, input_ids, attention_mask, needs=None, *, hidden=False):
    outputs = _forward(self, input_ids, attention_mask, needs, hidden=hidden)
    time.sleep(S_PER_KTOKEN * input_ids.numel() / 1000)
    return outputs


model_runner.ModelRunner.forward = forward

if __name__ == "__main__":
    sys.exit(main())
