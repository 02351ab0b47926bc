"""Optional dependencies: a missing one raises ImportError naming the package and the extra."""

import sys

import pytest
from kvpool import _deps, events

CASES = [
    # (function, module made missing, exact message)
    (_deps.require_torch, "torch",
     "KVPool, kvpool.attention and kvpool.write needs torch, which is not installed: "
     "pip install 'kvpool[torch]'"),
    (_deps.require_redis, "redis",
     "kvpool.store needs redis, which is not installed: pip install 'kvpool[store]'"),
    (_deps.require_xxhash, "xxhash",
     "kvpool.store needs xxhash, which is not installed: pip install 'kvpool[store]'"),
    (events._msgspec, "msgspec.msgpack",
     "kvpool.events needs msgspec, which is not installed: pip install 'kvpool[events]'"),
    (events._zmq, "zmq",
     "kvpool.events.EventPublisher needs pyzmq, which is not installed: "
     "pip install 'kvpool[events]'"),
]


@pytest.mark.parametrize("fn, module, message", CASES, ids=[c[1] for c in CASES])
def test_a_missing_dependency_names_package_and_extra(monkeypatch, fn, module, message):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError) as info:
        fn()
    assert str(info.value) == message
    assert isinstance(info.value.__cause__, ImportError)


@pytest.mark.parametrize("fn, module", [(c[0], c[1]) for c in CASES], ids=[c[1] for c in CASES])
def test_a_present_dependency_is_the_module(fn, module):
    pytest.importorskip(module)
    assert fn() is sys.modules[module]
