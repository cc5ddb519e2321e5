"""The shared-tier benchmark's ratios and tables (`radixserve.bench.shared_tier` runs it):
the judged ratios of a run's medians beside their targets, the two-node part's summary,
and the markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

#: the issue's targets, printed beside the ratios
TARGETS = {
    "peer_over_local": 1.5,
    "repeat_peer_over_repeat": 1.5,
    "peer_over_recompute": 0.3,
    "peer_cached_share": 0.9,
}
#: the measured turn-4 TTFTs of a conversation (`_one_conversation`'s keys)
TURNS = ("peer", "local", "repeat_peer", "repeat", "recompute")


def ratios(med: dict[str, float]) -> dict[str, float]:
    """The judged ratios of the medians: a peer read against a local device hit, twice
    like for like (the conversation's next turn; the prompt repeated), and against the
    recompute."""
    return {"peer_over_local": med["peer"] / med["local"],
            "repeat_peer_over_repeat": med["repeat_peer"] / med["repeat"],
            "peer_over_recompute": med["peer"] / med["recompute"]}  # fmt: skip


def summarise_other_node(
    other: list[dict[str, Any]], hosts: list[dict[str, Any]], shards: list[dict[str, Any]]
) -> dict[str, Any]:
    """The two-node part: the drained conversation read from the other node, the host
    tier's hits from the local and the remote node, and the index over 1 and 3 shards."""

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(row[key] for row in rows))

    peer = {k: median(other, f"{k}_ttft_ms") for k in TURNS}
    host = {k: median(hosts, f"{k}_ttft_ms") for k in ("remote", "local", "recompute")}
    return {
        "peer_rows": other,
        "peer_median_ms": peer,
        **ratios(peer),
        "peer_cached_share": min(
            r["peer_cached_tokens"] / max(1, r["prompt_tokens"]) for r in other
        ),  # fmt: skip
        "host_rows": hosts,
        "host_median_ms": host,
        "remote_over_local_host": host["remote"] / host["local"],
        "remote_host_over_recompute": host["remote"] / host["recompute"],
        "index_shards": shards,
    }


def format_other_node(o: dict[str, Any]) -> list[str]:
    peer, host = o["peer_median_ms"], o["host_median_ms"]
    lines = [
        "",
        "### Two nodes (a kvstore each; decode-0 and decode-1 on different nodes)",
        "",
        f"the next turn read from the other node: median {peer['peer']:.0f} ms, local hit "
        f"{peer['local']:.0f} ms, recompute {peer['recompute']:.0f} ms; the prompt repeated: "
        f"from the other node {peer['repeat_peer']:.0f} ms, local {peer['repeat']:.0f} ms",
        *_ratio_lines(o),
        f"host-tier hit: remote node {host['remote']:.0f} ms, local node {host['local']:.0f} ms, "
        f"recompute {host['recompute']:.0f} ms; remote / local = "
        f"{o['remote_over_local_host']:.2f}, remote / recompute = "
        f"{o['remote_host_over_recompute']:.3f}",
    ]
    for q in o["index_shards"]:
        lines.append(f"index over {q['shards']} shard(s), every shard asked at once: median "
                     f"{q['median_ms']:.2f} ms, p90 {q['p90_ms']:.2f} ms "
                     f"({q['round_trips']} round trips, {q['hashes']} page hashes)")  # fmt: skip
    return lines


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _ratio_lines(r: dict[str, Any]) -> list[str]:
    t = TARGETS
    return [
        f"peer / local hit (the next turn) = {r['peer_over_local']:.2f} (target <= "
        f"{t['peer_over_local']:g}); peer / local (the prompt repeated) = "
        f"{r['repeat_peer_over_repeat']:.2f} (target <= {t['repeat_peer_over_repeat']:g}); "
        f"peer / recompute = {r['peer_over_recompute']:.3f} (target <= "
        f"{t['peer_over_recompute']:g})",
        f"cached on the peer turn: {100 * r['peer_cached_share']:.0f} % of the prompt at least "
        f"(target >= {100 * t['peer_cached_share']:.0f} %)",
    ]


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"### Shared tier: turn 4 of a ~{r['system_tokens']}-token conversation after its "
        "decode worker drained",
        "",
        "| conv | prompt | peer ms | cached | from peer | pages read | read ms | peer "
        "admission ms | local hit ms | local cached | repeat: peer ms | repeat: local ms | "
        "recompute ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['conversation']} | {row['prompt_tokens']} | {row['peer_ttft_ms']:.0f} | "
            f"{row['peer_cached_tokens']} | {row['peer_tier_tokens']} | "
            f"{row['peer_read_pages']} | {row['peer_read_ms']:.1f} | "
            f"{_ms(row.get('peer_admission_ms'))} | {row['local_ttft_ms']:.0f} | "
            f"{row['local_cached_tokens']} | {row['repeat_peer_ttft_ms']:.0f} | "
            f"{row['repeat_ttft_ms']:.0f} | {row['recompute_ttft_ms']:.0f} |"
        )
    med, q = r["median_ms"], r["index_query"]
    lines += [
        "",
        f"median: the next turn read from a peer {med['peer']:.0f} ms, on its own worker "
        f"(local hit) {med['local']:.0f} ms; the prompt repeated: from a peer "
        f"{med['repeat_peer']:.0f} ms, local {med['repeat']:.0f} ms; recompute "
        f"{med['recompute']:.0f} ms",
        *_ratio_lines(r),
        f"index query, {q['shards']} shard: median {q['median_ms']:.2f} ms, p90 "
        f"{q['p90_ms']:.2f} ms ({q['round_trips']} round trips, {q['hashes']} page hashes)",
    ]
    if "other_node" in r:
        lines += format_other_node(r["other_node"])
    return "\n".join(lines)
