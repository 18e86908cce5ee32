"""The README's demo runs on the CPU and checks itself against the adapter files."""

from __future__ import annotations

import pytest

from lora_cupy.cli import main


def test_demo_runs_and_matches(capsys):
    assert main(["demo", "--device", "cpu", "--quiet", "--steps", "25", "--adapters", "5", "--slots", "3"]) == 0
    out = capsys.readouterr().out
    assert "matches the float64 computation" in out
    served = int(next(line.split()[-1] for line in out.splitlines() if line.startswith("requests_served")))
    assert served > 0
    loads = int(next(line.split()[-1] for line in out.splitlines() if line.startswith("slot_loads")))
    assert loads > 3  # 5 adapters through 3 slots: some slot was reused


def test_demo_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        main(["demo", "--slots", "0"])
