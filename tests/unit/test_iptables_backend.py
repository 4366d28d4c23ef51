"""`--iptables-backend auto`'s decision from what each backend holds, and the errors for
missing tools (the real tools in real namespaces: tests/kernel/test_iptables_backend.py)."""

from __future__ import annotations

import pytest

from agent.dataplane.iptables import backend as module
from agent.dataplane.iptables.backend import LEGACY, NFT, Census, decide

NONE = Census(rules=0, hint=False)


@pytest.mark.parametrize(
    ("nft", "legacy", "chosen", "reason"),
    [
        pytest.param(NONE, NONE, NFT, "0 rules in iptables-legacy, 0 in iptables-nft (a tie: "
                     "nft, the default of current distributions)", id="nothing anywhere: nft"),
        pytest.param(NONE, Census(3, False), LEGACY, "3 rules in iptables-legacy, 0 in "
                     "iptables-nft, not counting kube-bpf-proxy's own", id="more in legacy"),
        pytest.param(Census(5, False), Census(3, False), NFT, "3 rules in iptables-legacy, 5 in "
                     "iptables-nft, not counting kube-bpf-proxy's own", id="more in nft"),
        pytest.param(Census(2, False), Census(2, False), NFT, "2 rules in iptables-legacy, 2 in "
                     "iptables-nft (a tie: nft, the default of current distributions)",
                     id="a tie with rules: nft"),
        pytest.param(Census(0, True), Census(40, False), NFT,
                     "kubelet's KUBE-IPTABLES-HINT chain is in the nft tables",
                     id="kubelet's hint in nft outweighs legacy's rules"),
        pytest.param(Census(40, False), Census(0, True), LEGACY,
                     "kubelet's KUBE-IPTABLES-HINT chain is in the legacy tables",
                     id="kubelet's hint in legacy outweighs nft's rules"),
        pytest.param(Census(1, True), Census(4, True), LEGACY, "4 rules in iptables-legacy, 1 in "
                     "iptables-nft, not counting kube-bpf-proxy's own",
                     id="a hint in both decides nothing: counts do"),
        pytest.param(Census(0, False, "iptables-nft-save: Permission denied"), Census(1, False),
                     LEGACY, "1 rules in iptables-legacy, 0 in iptables-nft, not counting "
                     "kube-bpf-proxy's own (nft could not be read: iptables-nft-save: "
                     "Permission denied)", id="an unreadable backend counts as empty, said so"),
    ],
)  # fmt: skip
def test_auto_decides_by_kubelets_hint_then_rule_counts_then_nft(
    nft: Census, legacy: Census, chosen: str, reason: str
) -> None:
    assert decide({NFT: nft, LEGACY: legacy}) == (chosen, reason)


def test_with_one_backends_tools_installed_auto_takes_it() -> None:
    assert decide({LEGACY: Census(0, False)}) == (
        LEGACY, "only the legacy tools are installed (no iptables-nft)"
    )  # fmt: skip


def test_our_own_rules_are_not_counted() -> None:
    assert module._ours("-A KBP-SERVICES -d 10.96.0.1/32 -j KBP-SVC-X")
    assert module._ours('-A PREROUTING -m comment --comment "x" -j KBP-SERVICES')
    assert not module._ours("-A POSTROUTING -s 10.244.0.0/16 -j MASQUERADE")


def test_missing_tools_are_one_sentence_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module.shutil, "which", lambda tool: None)
    with pytest.raises(module.BackendError, match="iptables-legacy-restore not found"):
        module.choose_backend(LEGACY)
    with pytest.raises(module.BackendError, match="neither iptables-nft nor iptables-legacy"):
        module.choose_backend("auto")
