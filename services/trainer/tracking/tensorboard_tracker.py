"""TensorBoard: event files in the job's folder (tracking.tensorboard.dir under the run
directory), written by torch's SummaryWriter. A restarted trainer appends to the same folder
and first writes a SessionLog START at the first step it trains again, TensorFlow's restart
marker: TensorBoard then drops what the earlier process wrote for that step and later ones,
which are trained and logged again. (SummaryWriter's own purge_step writes a marker that
TensorBoard's readers of version-2 event files ignore.)"""

from __future__ import annotations

import time
from pathlib import Path

import yaml


class TensorboardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer = None

    def open(self, config: dict, resumed_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir))
        self.writer._get_file_writer().add_event(Event(
            step=resumed_step + 1, wall_time=time.time(),
            session_log=SessionLog(status=SessionLog.START)))
        if resumed_step == 0:
            # Indented four spaces: TensorBoard's text plugin renders Markdown.
            job = "\n".join(f"    {line}" for line in yaml.safe_dump(config, sort_keys=False)
                            .splitlines())
            self.writer.add_text("job", job, 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
