"""Task scheduling for one MoE layer (ScheMoE sections 3.2 and 4).

With pipelining degree r the exchange + experts block becomes 7r tasks
``C1^i A1^i D1^i E^i C2^i A2^i D2^i`` (compress, all-to-all, decompress, experts, compress,
all-to-all back, decompress). A scheduler orders the computing tasks; communication tasks run on
a separate lane as soon as their input and the previous communication task allow (Eq. 13-14).
"""

from moeflow.schedule.schedulers import SCHEDULERS, Scheduler, register_scheduler
from moeflow.schedule.tasks import COMM, COMPUTE, Task

__all__ = ["COMM", "COMPUTE", "SCHEDULERS", "Scheduler", "Task", "register_scheduler"]
