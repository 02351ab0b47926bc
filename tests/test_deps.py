"""Optional dependencies: a missing one raises ImportError naming the package and the extra.

The missing module is simulated (``sys.modules[name] = None``) in a child process: in this
one it would break the background threads of other tests (ZMQ publishers) that import lazily.
"""

import json
import subprocess
import sys

import pytest

CASES = [
    # (function, module made missing, exact message)
    ("_deps.require_torch", "torch",
     "KVPool, kvpool.attention and kvpool.write needs torch, which is not installed: "
     "pip install 'kvpool[torch]'"),
    ("_deps.require_redis", "redis",
     "kvpool.store needs redis, which is not installed: pip install 'kvpool[store]'"),
    ("_deps.require_xxhash", "xxhash",
     "kvpool.store needs xxhash, which is not installed: pip install 'kvpool[store]'"),
    ("events._msgspec", "msgspec.msgpack",
     "kvpool.events needs msgspec, which is not installed: pip install 'kvpool[events]'"),
    ("events._zmq", "zmq",
     "kvpool.events.EventPublisher needs pyzmq, which is not installed: "
     "pip install 'kvpool[events]'"),
]

CHILD = """
import importlib, importlib.util, json, sys
from kvpool import _deps, events
out = []
for fn, module in json.loads(sys.argv[1]):
    present = importlib.util.find_spec(module.split(".")[0]) is not None
    mod, name = fn.split(".")
    f = getattr({"_deps": _deps, "events": events}[mod], name)
    same = present and f() is importlib.import_module(module)
    saved = sys.modules.get(module)
    sys.modules[module] = None
    try:
        f()
        out.append([None, False, same])
    except ImportError as e:
        out.append([str(e), isinstance(e.__cause__, ImportError), same])
    finally:
        sys.modules[module] = saved
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    arg = json.dumps([[fn, module] for fn, module, _ in CASES])
    r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True,
                       check=True)
    return dict(zip([c[1] for c in CASES], json.loads(r.stdout), strict=True))


@pytest.mark.parametrize("fn, module, message", CASES, ids=[c[1] for c in CASES])
def test_a_missing_dependency_names_package_and_extra(results, fn, module, message):
    got, chained, _ = results[module]
    assert got == message
    assert chained


@pytest.mark.parametrize("fn, module", [(c[0], c[1]) for c in CASES], ids=[c[1] for c in CASES])
def test_a_present_dependency_is_the_module(results, fn, module):
    pytest.importorskip(module)
    assert results[module][2]
