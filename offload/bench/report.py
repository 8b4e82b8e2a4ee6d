"""The benchmark's report: the machine, the table, and the targets met or missed."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform

import torch

from .common import GB, meminfo
from .disk import DISK_THREADS


def machine() -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": cpus,
        "cpu": _cpu_model(),
        "mem_total_bytes": meminfo("MemTotal"),
        "loadavg": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _copy_bound(read: float, write: float) -> float:
    """GB/s of a copy that reads at `read` and then writes at `write` (no overlap)."""
    return 1 / (1 / read + 1 / write) if read and write else 0.0


def _pct(x: float, of: float) -> str:
    return f"{100 * x / of:.0f}%" if of else "-"


def report(r: dict) -> None:
    m = r["machine"]
    print(
        f"\noffload benchmark, {m['date']}: {m['cpus']} CPUs ({m['cpu']}), "
        f"{m['mem_total_bytes'] / 2**30:.1f} GiB RAM, torch {m['torch']} with "
        f"{m['torch_threads']} threads; load average at start "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg'])}, at end "
        f"{' '.join(f'{x:.2f}' for x in r['loadavg_end'])}"
    )
    disk = r.get("disk")
    w = disk["write_gbps"] if disk else 0.0
    wd = disk["write_durable_gbps"] if disk else 0.0
    rd = disk["read_gbps"] if disk else 0.0
    if disk:
        print(
            f"disk limits: write {w:.2f} GB/s ({wd:.2f} GB/s counting the fsync), read "
            f"{rd:.2f} GB/s ({'O_DIRECT' if disk['o_direct'] else 'buffered: read is the page cache'}, "
            f"{disk['bytes'] / 2**30:.1f} GiB file, 1 MiB pieces, best of {len(disk['runs'])} "
            f"runs with {' and '.join(map(str, DISK_THREADS))} threads at start and end)"
        )
    runs = []
    if r.get("lora"):
        runs.append(("LoRA r16", r["lora"]["kept"], "graphs kept"))
        runs.append(("LoRA r16", r["lora"]["recompute"], "recompute"))
    if r.get("full"):
        runs.append(("full FT", r["full"], "recompute"))
    rows, last = [], None
    for label, x, how in runs:
        if label != last:
            rows.append((f"{label}, in memory", "-", f"{x['in_memory_s_per_step']:.2f}", "1.00"))
            last = label
        lora = label.startswith("LoRA")
        rows.append(
            (
                f"{label}, engine ({how})",
                f"{x['budget_bytes'] / 2**30:.2f} GiB, pool {x['pages']}/{x['blocks']} blocks",
                f"{x['engine_s_per_step']:.2f}",
                f"{x['ratio']:.2f}",
                str(x["bitwise_equal_losses"]),
                f"{x['read_gb_per_step']:.2f} @ {x['read_gbps']:.2f} "
                + ("(page cache)" if lora else f"({_pct(x['read_gbps'], rd)})"),
                f"{x['written_gb_per_step']:.2f} @ {x['write_gbps']:.2f} "
                f"({_pct(x['write_gbps'], w)})"
                if x["written_gb_per_step"]
                else "0",
                f"{x['stall_s_per_step']:.2f}",
            )
        )
    if rows:
        head = ("run", "budget", "s/step", "x mem", "bitwise", "read GB/step @ GB/s",
                "written GB/step @ GB/s", "stall s")  # fmt: skip
        widths = [
            max(len(row[i]) for row in [head, *rows] if i < len(row)) for i in range(len(head))
        ]
        print(f"{r['model']}; batch {r['batch']} x {r['seq']} tokens")
        for row in [head, *rows]:
            print("  ".join(str(c).ljust(wd) for c, wd in zip(row, widths)).rstrip())
    c = r.get("checkpoint")
    if c:
        how = "renamed into it, not copied" if c["swap_files_renamed"] else "copied"
        print(
            f"checkpoint of the full fine-tune, {c['bytes'] / GB:.2f} GB (swap files "
            f"{c['swap_file_bytes'] / GB:.2f} GB, {how}; resident state and Adam moments "
            f"{c['resident_bytes'] / GB:.2f} GB, written): save {c['save_s']:.2f} s "
            f"({c['save_gbps']:.2f} GB/s effective, {_pct(c['save_gbps'], wd)} of fsynced "
            f"write), load {c['load_s']:.2f} s ({c['load_gbps']:.2f} GB/s effective; the next "
            f"step reads the regions from the checkpoint instead of the swap); to another "
            f"filesystem the swap files are copied at {c['copy_gbps']:.2f} GB/s "
            f"({_pct(c['copy_gbps'], wd)} of fsynced write; a copy reads as much as it writes, "
            f"and reading then writing at the disk's limits gives {_copy_bound(rd, wd):.2f} GB/s)"
        )
    h = r.get("headline")
    if h:
        print(
            f"headline: {h['params'] / 1e9:.2f}B-parameter Llama ({h['shape']['num_hidden_layers']}"
            f" x {h['shape']['hidden_size']}), training state {h['training_state_bytes'] / GB:.1f}"
            f" GB vs {h['mem_total_bytes'] / GB:.1f} GB of RAM: in memory "
            + ("fits" if h["in_memory_fits"] else "cannot hold it")
        )
        if "skipped" in h or "failed" in h:
            print(f"  not run: {h.get('skipped') or h.get('failed')}")
        else:
            print(
                f"  engine, budget {h['budget_bytes'] / 2**30:.1f} GiB, batch {h['batch']} x "
                f"{h['seq']}: {h['s_per_step']:.0f} s/step ({h['tokens_per_s']:.1f} tokens/s), "
                f"peak RSS {h['peak_rss_bytes'] / 2**30:.2f} GiB (engine's malloc mmap threshold "
                f"{h.get('malloc_mmap_threshold') or 'not set'}) = "
                f"{h['baseline_rss_bytes'] / 2**30:.2f} GiB interpreter with torch and "
                f"transformers + {h['training_rss_bytes'] / 2**30:.2f} GiB training (engine-"
                f"accounted {h['peak_bytes_accounted'] / 2**30:.2f} GiB), swap "
                f"{h['swap_bytes'] / GB:.1f} GB"
                f" (created in {h['create_s']:.0f} s, removed); per step read "
                f"{h['read_gb_per_step']:.1f} GB @ {h['read_gbps']:.2f} GB/s "
                f"({_pct(h['read_gbps'], rd)}), wrote {h['written_gb_per_step']:.1f} GB @ "
                f"{h['write_gbps']:.2f} GB/s ({_pct(h['write_gbps'], w)}), stall "
                f"{h['stall_s_per_step']:.0f} s"
            )
    t = r.get("targets")
    if t:
        print("targets: " + "; ".join(f"{k} {v}" for k, v in t.items()))


def targets(r: dict) -> dict:
    out = {}
    disk = r.get("disk")
    if r.get("lora"):
        x = r["lora"]["kept"]["ratio"]
        out["LoRA step ratio <= 1.15"] = f"{x:.2f} {'met' if x <= 1.15 else 'MISSED'}"
    if not disk:
        return out
    w, wd, rd = disk["write_gbps"], disk["write_durable_gbps"], disk["read_gbps"]

    def check(name: str, got: float, limit: float) -> None:
        share = got / limit if limit else 0.0
        out[name] = f"{100 * share:.0f}% {'met' if share >= 0.7 else 'MISSED'}"

    if r.get("full"):
        check("full FT read >= 70% of disk", r["full"]["read_gbps"], rd)
        check("full FT write >= 70% of disk", r["full"]["write_gbps"], w)
    h = r.get("headline")
    if h and "s_per_step" in h:
        check("headline read >= 70% of disk", h["read_gbps"], rd)
        check("headline write >= 70% of disk", h["write_gbps"], w)
    if r.get("checkpoint"):
        c = r["checkpoint"]
        check("checkpoint save >= 70% of fsynced write", c["save_gbps"], wd)
        check("checkpoint load >= 70% of read", c["load_gbps"], rd)
        check("checkpoint copy to another filesystem >= 70% of fsynced write", c["copy_gbps"], wd)
    return out
