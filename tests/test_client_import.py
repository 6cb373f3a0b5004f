"""A robot machine has numpy and openpi-client, not jax: `import oxygen_jax.client` must work there.

Each check runs in a fresh interpreter whose import system refuses every installed (site-packages)
top-level package except the ones a robot has; the package face (`oxygen_jax/__init__.py`) resolves its
public names on first use, so the client never pulls in the runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import oxygen_jax
from helpers import REPO

# Runs in the child: argv[1] is the comma-separated allow-list, argv[2] the code to run under it.
_BLOCKER = r"""
import importlib.machinery, json, site, sys, sysconfig
ALLOWED = set(sys.argv[1].split(","))
SITE = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages(),
              site.getusersitepackages()})
REFUSED = []

class _RobotMachine:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if path is not None or top in ALLOWED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(top)
        where = [spec.origin or ""] + list(spec.submodule_search_locations or []) if spec else []
        if any(w.startswith(SITE) for w in where):
            REFUSED.append(top)
            raise ModuleNotFoundError(f"{top} is not installed on the robot", name=top)
        return None

sys.meta_path.insert(0, _RobotMachine())
out = {}
exec(sys.argv[2])
out["refused"] = sorted(set(REFUSED))
out["heavy_loaded"] = sorted(m for m in ("jax", "jaxlib", "flax", "optax", "orbax", "tensorflow") if m in sys.modules)
print(json.dumps(out))
"""

# A synchronous client over a scripted policy: call k answers chunk k, a[j] = 100 k + j.
_USE_CLIENT = r"""
import numpy as np
from oxygen_jax.client import AsyncChunkClient

class _Policy:
    calls = 0
    def infer(self, obs):
        k, _Policy.calls = _Policy.calls, _Policy.calls + 1
        return {"actions": (100.0 * k + np.arange(4.0))[:, None]}

with AsyncChunkClient(_Policy(), execution_horizon=2, asynchronous=False) as robot:
    out["actions"] = [float(robot.act({"state": np.zeros(2)})[0]) for _ in range(6)]
try:
    import oxygen_jax
    oxygen_jax.Engine
    out["engine"] = "resolved"
except ImportError as e:
    out["engine"] = f"ImportError: {e.name}"
"""


def _on_robot(allowed: tuple[str, ...], code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _BLOCKER, ",".join(allowed), code], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_client_imports_and_runs_with_numpy_as_the_only_installed_package():
    out = _on_robot(("numpy",), _USE_CLIENT)
    # Synchronous, horizon 2: two actions of each chunk, each new chunk from its index 0.
    assert out["actions"] == [0.0, 1.0, 100.0, 101.0, 200.0, 201.0]
    assert out["heavy_loaded"] == []
    # The blocker is real: the runtime behind a public name cannot load on the robot.
    assert out["engine"] == "ImportError: jax"
    assert out["refused"] == ["jax"]


def test_the_client_with_openpis_websocket_policy_needs_only_the_robot_packages():
    pytest.importorskip("openpi_client", reason="openpi-client not installed: pip install --no-deps -r "
                                                "requirements-test.txt")
    # openpi-client's websocket policy: msgpack + websockets + numpy, and typing_extensions (undeclared).
    robot = ("numpy", "openpi_client", "msgpack", "websockets", "typing_extensions")
    code = ("from openpi_client import msgpack_numpy, websocket_client_policy\n"
            "import oxygen_jax.client\n"
            "out['roundtrip'] = msgpack_numpy.unpackb(msgpack_numpy.packb({'a': __import__('numpy').arange(3)}))"
            "['a'].tolist()\n")
    out = _on_robot(robot, code)
    assert out == {"roundtrip": [0, 1, 2], "refused": [], "heavy_loaded": []}


def test_every_public_name_of_the_package_face_resolves_and_unknown_names_do_not():
    for name in oxygen_jax.__all__:
        value = getattr(oxygen_jax, name)
        assert getattr(value, "__name__", name) == name, f"oxygen_jax.{name} is {value!r}"
    assert set(oxygen_jax.__all__) <= set(dir(oxygen_jax))
    from oxygen_jax import Engine, model_config, run  # a public name and a submodule, side by side

    assert Engine is oxygen_jax.runtime.engine.Engine and isinstance(model_config("tiny"), oxygen_jax.ModelConfig)
    assert run.__name__ == "oxygen_jax.run"
    with pytest.raises(AttributeError, match="no_such_name"):
        oxygen_jax.no_such_name
