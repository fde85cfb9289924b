"""What several test folders use: the repository root, and helpers per component (servers on loopback, tiny models, ports, waiting)."""

from pathlib import Path

#: The repository root.
ROOT = Path(__file__).resolve().parents[2]
