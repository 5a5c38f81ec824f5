"""What the tools share about the hybrid all-to-all + ring: the ``--ulysses`` flag and the checks that a
world, a head count and a sequence length can take it (``xcp run``, ``xcp plan``, ``xcp sanitize`` and
``xcp bench`` all name the flag the same way).
"""

from __future__ import annotations

from .. import schedule

FLAG = "--ulysses"
HELP = (
    "U, the ranks of a head group (hybrid all-to-all + ring, xcp.attention(..., ulysses=U)): the P ranks form "
    "head groups of U consecutive ranks, which exchange heads for tokens in an all-to-all, and rings of the "
    "R = P/U ranks with equal r %% U; U divides P and --heads. 1: the ring alone; P: the all-to-all alone"
)


def check_flag(ulysses: int, world: int, heads: int, world_flag: str = "--world") -> int:
    """R = world // ulysses, for the ``--ulysses`` flag: a ValueError naming it, the expected and the actual
    value unless it divides ``world`` (given by ``world_flag``) and ``heads``."""
    if world % ulysses:
        raise ValueError(
            f"{FLAG}: expected a divisor of {world_flag} {world} (P = ulysses x ring ranks); got {ulysses}"
        )
    if heads % ulysses:
        raise ValueError(
            f"{FLAG}: expected a divisor of --heads {heads} (each rank of a head group takes heads / "
            f"ulysses of the query heads); got {ulysses}"
        )
    return world // ulysses


def check_seq(seq: int, world: int, ulysses: int, balance: str, seq_flag: str = "--seq") -> None:
    """A ValueError naming ``seq_flag`` unless ``seq`` tokens can be placed by ``xcp.shard(..., ulysses=U)``:
    split by ``balance`` over the R = P/U ring positions, and each ring shard into U pieces (P divides S;
    with U = 1, the ring alone, only what ``balance`` needs)."""
    rings = world // ulysses
    schedule.check_seq_len(seq, rings, balance, what=seq_flag)
    if ulysses > 1 and seq % world:
        also = f"; {balance} splits any length only with {FLAG} 1" if balance in schedule.DOCUMENT_BALANCES else ""
        raise ValueError(
            f"{seq_flag}: expected a multiple of {world} ranks with {FLAG} {ulysses} (each of the {rings} "
            f"ring shards is cut into {ulysses} pieces{also}); got {seq}"
        )
