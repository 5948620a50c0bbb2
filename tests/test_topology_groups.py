"""A rank that declines the package (runs upstream's cache) never builds the
package's process groups: the groups are named outside torch's group counter, so
SGLang's later default-synchronised ``new_group`` (the storage sync groups of a
runtime attach) still finds the same name on every rank (two real gloo processes)."""

import contextlib
import socket
import time
from datetime import timedelta

import torch.multiprocessing as mp


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tree:  # what replica_neighbours reads; a TP world of 2
    attn_cp_group = attn_tp_group = None
    tp_world_size = 2
    tp_group = None
    pp_size = 1
    host_memory_mode = "buffer_only"


def _worker(rank, port, with_package_on_rank0, q):
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    out = {}
    if with_package_on_rank0 and rank == 0:
        from hicache_existence.integrations.sglang import topology

        t0 = time.monotonic()
        try:
            topology.build(_Tree(), 3.0, agreement=False)
            out["build"] = "ok"
        except Exception as exc:
            out["build"] = type(exc).__name__
        out["build_s"] = round(time.monotonic() - t0, 1)
    else:
        time.sleep(4.0 if with_package_on_rank0 else 0)
    # sglang's later group (create_custom_parallel_group at a runtime attach)
    t0 = time.monotonic()
    try:
        g = dist.new_group(ranks=[0, 1], backend="gloo", timeout=timedelta(seconds=5))
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, group=g)
        out["later_group"] = f"ok sum={int(t)}"
    except Exception as exc:
        out["later_group"] = f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s"
    q.put((rank, out))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _run(with_pkg):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    ps = [ctx.Process(target=_worker, args=(r, port, with_pkg, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    return res


def test_control_without_the_package():
    res = _run(False)
    assert res[0]["later_group"] == "ok sum=3" and res[1]["later_group"] == "ok sum=3"


def test_a_declined_peer_does_not_break_later_groups():
    res = _run(True)
    print(res)
    assert res[0]["later_group"] == "ok sum=3", res
    assert res[1]["later_group"] == "ok sum=3", res
