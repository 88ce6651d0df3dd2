# SPDX-License-Identifier: MPL-2.0
"""``python -m gpushm list|inspect [--json]``: the streams of this machine, as the ``gpushm``
command shows them (same keys with ``--json``), for installs that have only the wheel."""

import argparse
import json
import sys

from . import Error, inspect, streams

# Control and invisible formatting characters (bidirectional overrides, zero-width ones) a peer
# may put in a name, caps or an error, shown escaped rather than sent to the terminal.
_INVISIBLE = {0xAD, 0x061C, 0x180E, 0xFEFF, *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x206A)}


def _clean(text) -> str:
    import unicodedata

    return "".join(
        c.encode("unicode_escape").decode() if unicodedata.category(c) == "Cc" or ord(c) in _INVISIBLE else c
        for c in str(text)
    )


def _short_caps(caps):
    if not caps:
        return ""
    fields = [f.strip() for f in caps.split(",")]
    out = fields[0]
    kv = {}
    for f in fields[1:]:
        if "=" in f:
            k, v = f.split("=", 1)
            kv[k.strip()] = v.split(")")[-1].strip()
    if "format" in kv:
        out += " " + kv["format"]
    if "width" in kv and "height" in kv:
        out += f" {kv['width']}x{kv['height']}"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpushm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="every stream in the stream directories")
    ls.add_argument("--json", action="store_true")
    ins = sub.add_parser("inspect", help="one stream: caps, ring, clients")
    ins.add_argument("--json", action="store_true")
    ins.add_argument("stream", help="a stream name, or a socket path (with a '/')")
    a = p.parse_args(argv)
    if a.cmd == "list":
        found = streams()
        if a.json:
            print(json.dumps(found, indent=2, default=str))
            return 0
        print(f"{'NAME':<20} {'CLIENTS':>7} {'FPS':>7} {'SLOTS':>5}  CAPS")
        for s in found:
            if s["state"] == "live":
                print(f"{_clean(s['name']):<20} {s['clients']:>7} {s['fps']:>7.1f} {s['slots']:>5}  {_clean(_short_caps(s['caps']))}")
            else:
                print(f"{_clean(s['name']):<20} {'-':>7} {'-':>7} {'-':>5}  {s['state']}: {_clean(s.get('error', ''))}")
        return 0
    try:
        s = inspect(a.stream)
    except (Error, ValueError) as e:
        print(f"gpushm: {_clean(a.stream)}: {_clean(e)}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    print(f"stream    {_clean(s['name'])}\nsocket    {_clean(s['path'])}")
    print(f"producer  pid {s['producer_pid']} (uid {s['producer_uid']}), up {s['uptime_s']:.1f} s")
    print(f"caps      {_clean(s['caps'])}")
    print(f"ring      {s['slots']} slots of {s['slot_size']} bytes")
    print(f"frames    {s['frames_sent']} published ({s['fps']:.1f}/s), {s['frames_dropped']} dropped")
    for c in s["client_list"]:
        print(
            f"  #{c['id']} pid {c['pid']} {_clean(repr(c['name']))}: {_clean(c['mode'])}, delivered {c['delivered']}, "
            f"dropped {c['dropped']}, held {c['held']}, latency p50 {c['latency_p50_us']} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
