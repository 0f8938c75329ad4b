"""Self-check of a ragged page table against the lengths it encodes (a debug aid).

``RaggedAttentionMetadata(check_page_table=True)`` runs it after every ``prepare()`` and
reports at most ``page_table_check_budget`` problems through logging instead of raising.
"""

from __future__ import annotations

import numpy as np


def page_table_problems(
    kv_lens: np.ndarray,
    logical_nb: np.ndarray,
    num_blocks: np.ndarray,
    indptr: np.ndarray,
    last_page_len: np.ndarray,
    num_indices: int,
    block_size: int,
) -> list[str]:
    """Inconsistencies between the ragged page table and the lengths (empty when sound).

    O(num_seqs) host checks: exposed pages cover the logical ones, indptr steps by the
    exposed pages and ends at the number of indices, and pages + last_page_len give kv_lens.
    """
    problems = []
    short = num_blocks < logical_nb
    if short.any():
        b = int(np.argmax(short))
        problems.append(f"seq {b}: {num_blocks[b]} pages exposed < {logical_nb[b]} logical")
    if not np.array_equal(indptr[1:] - indptr[:-1], num_blocks):
        problems.append("paged_kv_indptr differences != num_blocks")
    if num_indices != int(indptr[-1]):
        problems.append(f"{num_indices} indices but indptr ends at {int(indptr[-1])}")
    rebuilt = np.where(logical_nb > 0, (logical_nb - 1) * block_size + last_page_len, 0)
    if not np.array_equal(rebuilt, kv_lens):
        b = int(np.argmax(rebuilt != kv_lens))
        problems.append(f"seq {b}: pages + last_page_len give {rebuilt[b]} != kv_len {kv_lens[b]}")
    return problems
