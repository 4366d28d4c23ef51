"""PB-1's new flow taken apart: what one random access to each map a new flow touches
costs at 100k Services, measured alone (issue 15: why the spread / ACK target is out of
reach on a machine, and what a change of map type would buy).

One small tc program per access, on maps of the sizes and fill PB-1's 100k run has
(frontends: 200k of 262,144; slots: 1M as a hash keyed (set, index), kbp_slots' layout
before ABI 6, and the same count as an array, its layout since; per-service counters: a
per-CPU array; conntrack: 100k flows in an LRU and in a plain hash of 262,144), each
called once per run with a random key from the frame, interleaved in chunks like
datapath.py, net of an empty program. Each access reads or
writes the value, so the cost of reaching it is counted; each map gets its own keys, so
no access warms another's memory.

    .venv/bin/python -m bench.newflow_parts [--calls C]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import struct
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import libbpf
from bench.common.report import header, machine

SOURCE = r"""
struct fe_key { u32 w[6]; };          /* struct kbp_frontend_key's size */
struct fe_val { u32 w[10]; };         /* struct kbp_service's */
struct slot_key { u32 set_id; u32 index; };
struct slot_val { u32 w[8]; };        /* struct kbp_slot's */
struct ct_key { u32 w[10]; };         /* struct kbp_ct_key's */
struct ct_val { u64 w[10]; };         /* struct kbp_ct_entry's */
struct cnt { u64 w[4]; };             /* struct kbp_counters */
BPF_TABLE("hash", struct fe_key, struct fe_val, fe, 262144);
BPF_TABLE("hash", struct slot_key, struct slot_val, slots, 1048576);
BPF_TABLE("array", u32, struct slot_val, slot_array, 1048576);
BPF_TABLE("percpu_array", u32, struct cnt, counters, 262144);
BPF_TABLE("lru_hash", struct ct_key, struct ct_val, ct_miss, 262144);
BPF_TABLE("lru_hash", struct ct_key, struct ct_val, ct_lru, 262144);
BPF_TABLE("hash", struct ct_key, struct ct_val, ct_hash, 262144);

static __always_inline int words(struct __sk_buff *skb, u32 *out)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;

	if (data + 14 + 8 > end)
		return -1;
	__builtin_memcpy(out, data + 14, 8);
	return 0;
}

int empty(struct __sk_buff *skb) { return 0; }

int frontend(struct __sk_buff *skb)
{
	struct fe_key k = {};
	struct fe_val *v;
	u32 w[2];

	if (words(skb, w))
		return 0;
	k.w[0] = w[0] % 200000;
	v = fe.lookup(&k);
	return v && v->w[3] == 7;
}

int slot_hash(struct __sk_buff *skb)
{
	struct slot_key k = {};
	struct slot_val *v;
	u32 w[2];

	if (words(skb, w))
		return 0;
	k.set_id = w[0] % 100000;
	k.index = w[1] % 10;
	v = slots.lookup(&k);
	return v && v->w[3] == 7;
}

int slot_arr(struct __sk_buff *skb)
{
	struct slot_val *v;
	u32 w[2], i;

	if (words(skb, w))
		return 0;
	i = w[0] % 1000000;
	v = slot_array.lookup(&i);
	return v && v->w[3] == 7;
}

int counter(struct __sk_buff *skb)
{
	struct cnt *c;
	u32 w[2], i;

	if (words(skb, w))
		return 0;
	i = w[0] % 200000;
	c = counters.lookup(&i);
	if (c) {
		c->w[0] += 1;
		c->w[2] += 1;
	}
	return 0;
}

int ct_lookup_miss(struct __sk_buff *skb)
{
	struct ct_key k = {};
	u32 w[2];

	if (words(skb, w))
		return 0;
	k.w[0] = w[0];
	k.w[1] = w[1] | 1; /* the filled keys have word 1 == 2 */
	return ct_miss.lookup(&k) != 0;
}

int ct_insert_lru(struct __sk_buff *skb)
{
	struct ct_key k = {};
	struct ct_val v = {};
	u32 w[2];

	if (words(skb, w))
		return 0;
	k.w[0] = w[0];
	k.w[1] = w[1] | 1;
	ct_lru.update(&k, &v);
	return 0;
}

int ct_insert_hash(struct __sk_buff *skb)
{
	struct ct_key k = {};
	struct ct_val v = {};
	u32 w[2];

	if (words(skb, w))
		return 0;
	k.w[0] = w[0];
	k.w[1] = w[1] | 1;
	ct_hash.update(&k, &v);
	return 0;
}
"""

PROGRAMS = {
    "frontend": "frontend hash lookup, 200k of 262,144 (hit)",
    "slot_hash": "slot lookup, hash of 1M (set, index) (hit; kbp_slots before ABI 6)",
    "slot_arr": "slot lookup, array of 1M (kbp_slots since ABI 6)",
    "counter": "per-service counters, per-CPU array (+= 2 fields)",
    "ct_lookup_miss": "conntrack lookup, LRU of 100k flows (miss)",
    "ct_insert_lru": "conntrack insert, LRU_HASH, new key",
    "ct_insert_hash": "conntrack insert, plain HASH (prealloc), new key",
}


def fill(module: Any) -> None:  # a bcc BPF module
    fe, slots = module["fe"], module["slots"]
    for i in range(200000):
        k = fe.Key()
        k.w[0] = i
        fe[k] = fe.Leaf()
    for s in range(100000):
        for j in range(10):
            k = slots.Key()
            k.set_id, k.index = s, j
            slots[k] = slots.Leaf()
    for table in (module["ct_miss"], module["ct_lru"], module["ct_hash"]):
        for i in range(100000):
            k = table.Key()
            k.w[0], k.w[1] = i, 2
            table[k] = table.Leaf()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    from bcc import BPF

    info = machine()
    header("newflow_parts", info)
    module = BPF(text=SOURCE.encode())
    try:
        fds = {n: module.load_func(n.encode(), BPF.SCHED_CLS).fd for n in ["empty", *PROGRAMS]}
        fill(module)
        rng = random.Random(1)
        frames = [
            bytes(14) + struct.pack("=II", rng.getrandbits(32), rng.getrandbits(32)) + bytes(42)
            for _ in range(args.calls)
        ]
        samples: dict[str, list[int]] = {n: [] for n in fds}
        for start in range(0, args.calls, 250):
            for name, fd in fds.items():
                for frame in frames[start : start + 250]:
                    samples[name].append(libbpf.prog_test_run(fd, frame).duration_ns)
    finally:
        module.cleanup()
    floor = statistics.median(samples["empty"])
    print(f"{'one random access (single runs, median ns over the empty program)':<64} net")
    for name, what in PROGRAMS.items():
        print(f"  {what:<62} {statistics.median(samples[name]) - floor:>+6.0f}")
    print(f"(empty program {floor:.0f} ns; load average now {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
