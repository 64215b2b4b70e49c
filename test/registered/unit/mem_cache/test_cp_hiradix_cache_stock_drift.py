"""CpHiRadixCache against the installed sglang: no stock method may reach ``backuped`` / ``host_value``.

Our nodes keep their host state in ``host_len`` + ``cp_hicache``; ``node.host_value`` stays ``None`` and
``node.backuped`` is therefore always False. A stock ``HiRadixCache`` / ``RadixCache`` method that reads
either one would silently take the wrong branch on our nodes, so every such method must be overridden
by ``CpHiRadixCache``. This reads the source text of the installed stock classes: an sglang upgrade
that adds or changes such a method fails here instead of in a server.
"""

import inspect
import re
import unittest
from types import SimpleNamespace

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import (  # noqa: E402
    CpHiRadixCache,
    _check_supported,
)

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

STOCK_CLASSES = (HiRadixCache, RadixCache)
HOST_STATE = re.compile(r"\b(backuped|host_value)\b")

# Stock methods that read the host state but cannot run on a CP cache, and why. Each reason must stay
# true: the test below checks the guard it names.
UNREACHABLE = {
    # Both run only with stock's ``enable_storage``, which CpHiRadixCache never sets: its L3 tier is its
    # own (``cp_storage``: the stock cache is built without a backend), other backends are refused at
    # construction (``_check_supported``) and any backend at runtime (``attach_storage_backend``).
    "write_backup_storage": "storage backend",
    "_insert_helper_host": "storage backend",
}


def _functions(cls):
    """Name -> plain function of every method written in ``cls`` (properties by their getter); hooks
    that ``typing.Protocol`` adds to the class dict are not ours."""
    functions = {}
    for name, member in vars(cls).items():
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        elif isinstance(member, property):
            member = member.fget
        if inspect.isfunction(member) and member.__qualname__.startswith(f"{cls.__name__}."):
            functions[name] = member
    return functions


def _cp_functions():
    """Name -> function of every method ``CpHiRadixCache`` or one of its parts (the plugin's classes
    in its MRO) writes, the one an attribute lookup finds where two write the same name."""
    functions = {}
    ours = [cls for cls in CpHiRadixCache.__mro__ if cls.__module__.startswith("sglang_cp_shared_kv.")]
    for cls in reversed(ours):
        functions.update(_functions(cls))
    return functions


def stock_methods_reading_host_state():
    """``{name: "Class.name"}`` of stock methods whose source mentions ``backuped`` or ``host_value``."""
    found = {}
    for cls in STOCK_CLASSES:
        for name, function in _functions(cls).items():
            if HOST_STATE.search(inspect.getsource(function)):
                found.setdefault(name, f"{cls.__name__}.{name}")
    return found


class TestStockHostPathsAreOverridden(CustomTestCase):
    def test_every_stock_method_reading_host_state_is_overridden(self):
        found = stock_methods_reading_host_state()
        self.assertIn("load_back", found)  # the scan does see the stock host paths
        overridden = _cp_functions()
        missing = sorted(
            qualified
            for name, qualified in found.items()
            if name not in overridden and name not in UNREACHABLE
        )
        self.assertEqual(
            missing,
            [],
            "stock methods read node.backuped / node.host_value, which CP nodes never set; override "
            "them in CpHiRadixCache (or, if a CP cache can never run them, add them to UNREACHABLE "
            "with the guard that makes it so)",
        )

    def test_unreachable_list_is_current(self):
        found = stock_methods_reading_host_state()
        for name in UNREACHABLE:
            self.assertIn(name, found, f"{name} no longer reads host state: drop it from UNREACHABLE")
            self.assertNotIn(name, _cp_functions(), f"{name} is overridden now")

    def test_the_storage_guard_holds(self):
        ok, message = CpHiRadixCache.attach_storage_backend(None, "file")
        self.assertFalse(ok)
        self.assertIn("not supported", message)
        pool = NSATokenToKVPool.__new__(NSATokenToKVPool)  # only its type is looked at
        with self.assertRaisesRegex(ValueError, "hicache-storage-backend nixl"):
            _check_supported(
                pool, SimpleNamespace(hicache_storage_backend="nixl", hicache_mem_layout="layer_first")
            )
        self.assertFalse(HiRadixCache.__init__.__code__ is CpHiRadixCache.__init__.__code__)

    def test_every_override_of_a_stock_method_says_what_differs(self):
        stock = set().union(*(_functions(cls) for cls in STOCK_CLASSES))
        undocumented = sorted(
            name
            for name, function in _cp_functions().items()
            if name in stock and not (function.__doc__ or "").strip()
        )
        self.assertEqual(undocumented, [], "each override needs a docstring line: what differs")


if __name__ == "__main__":
    unittest.main()
