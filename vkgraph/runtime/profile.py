"""GPU timestamps per dispatch (VKGRAPH_PROFILE=1): a table at exit and a Chrome-trace JSON file."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ..flags import flag
from .vk import NULL, Keep, check, ffi, lib, vk

if TYPE_CHECKING:
    from .device import Device
    from .submission import Submission

_QUERIES = 1024  # per submission: two per dispatch


class Profiler:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.period_ns = device.info.timestamp_period
        self.pools: dict[int, Any] = {}
        self.events: list[tuple[str, float, float]] = []  # (name, start ns, end ns)
        self.enabled = device.info.timestamps

    def _pool(self, sub: Submission) -> Any:
        pool = self.pools.get(id(sub))
        if pool is None:
            k = Keep()
            ci = k.struct("VkQueryPoolCreateInfo", queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=_QUERIES)
            out = ffi.new("VkQueryPool*")
            check(lib.vkCreateQueryPool(self.device.device, ci, NULL, out), "vkCreateQueryPool")
            pool = self.pools[id(sub)] = out[0]
        return pool

    def begin(self, sub: Submission) -> None:
        sub.profile = []
        if self.enabled:
            lib.vkCmdResetQueryPool(sub.cmd, self._pool(sub), 0, _QUERIES)

    def full(self, sub: Submission) -> bool:
        return 2 * len(sub.profile) + 2 > _QUERIES

    def before(self, sub: Submission, name: str) -> None:
        if self.enabled:
            q = 2 * len(sub.profile)
            sub.profile.append((name, q))
            lib.vkCmdWriteTimestamp(sub.cmd, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self._pool(sub), q)

    def after(self, sub: Submission) -> None:
        if self.enabled:
            q = 2 * len(sub.profile) - 1
            lib.vkCmdWriteTimestamp(sub.cmd, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self._pool(sub), q)

    def collect(self, sub: Submission) -> None:
        if not sub.profile:
            return
        n = 2 * len(sub.profile)
        data = ffi.new("uint64_t[]", n)
        res = lib.vkGetQueryPoolResults(self.device.device, self._pool(sub), 0, n, 8 * n, data, 8,
                                        vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
        check(res, "vkGetQueryPoolResults")
        for name, q in sub.profile:
            self.events.append((name, data[q] * self.period_ns, data[q + 1] * self.period_ns))
        sub.profile = []

    def table(self) -> str:
        per: dict[str, list[float]] = defaultdict(list)
        for name, t0, t1 in self.events:
            per[name].append((t1 - t0) / 1e3)
        rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))
        lines = [f"{'kernel':40s} {'count':>7s} {'total us':>11s} {'mean us':>9s} {'min us':>9s}"]
        for name, ts in rows:
            lines.append(f"{name[:40]:40s} {len(ts):7d} {sum(ts):11.1f} {sum(ts) / len(ts):9.2f} {min(ts):9.2f}")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        base = min((t0 for _, t0, _ in self.events), default=0.0)
        return {"traceEvents": [
            {"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": (t0 - base) / 1e3, "dur": (t1 - t0) / 1e3}
            for name, t0, t1 in self.events]}

    def report(self) -> None:
        if not self.events:
            return
        print(self.table())
        path = flag("VKGRAPH_PROFILE_FILE")
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        print(f"vkgraph: Chrome trace of {len(self.events)} dispatches written to {path}")

    def destroy(self) -> None:
        for pool in self.pools.values():
            lib.vkDestroyQueryPool(self.device.device, pool, NULL)
        self.pools.clear()
