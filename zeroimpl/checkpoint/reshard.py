"""Resharding arithmetic: which saved ranges fill which ranges of a new shard. Integers only.

A *piece* is a range ``[start, end)`` of one flattened parameter. A saving rank writes the pieces it owns
(``ShardLayout.pieces(rank)``), concatenated in that order, into its file; so an element of a saved file is
addressed by ``(saved rank, offset in the file's data)``. Loading under another layout -- another world
size, bucket size or alignment -- intersects each piece the new rank owns with the saved pieces of the
same parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import ShardLayout, overlap


@dataclass(frozen=True)
class Copy:
    """Copy ``length`` elements from offset ``source_offset`` of saved rank ``source_rank``'s data (element
    ``piece_offset`` of its piece number ``source_piece``) to offset ``target_offset`` of the new rank's shard
    of bucket ``target_bucket`` (element ``target_piece_offset`` of its piece number ``target_piece``)."""

    source_rank: int
    source_offset: int
    target_bucket: int
    target_offset: int
    length: int
    source_piece: int = 0
    piece_offset: int = 0
    target_piece: int = 0
    target_piece_offset: int = 0


def saved_pieces(layout: ShardLayout) -> dict[int, list[tuple[int, int, int, int, int]]]:
    """For every parameter, its saved pieces ``(start, end, rank, file offset, piece number)``, by ``start``."""
    by_param: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for rank in range(layout.world_size):
        offset = 0
        for number, piece in enumerate(layout.pieces(rank)):
            by_param.setdefault(piece.param_index, []).append((piece.param_start, piece.param_end, rank, offset,
                                                               number))
            offset += piece.length
    for pieces in by_param.values():
        pieces.sort()
    return by_param


def plan(saved: ShardLayout, new: ShardLayout, rank: int) -> list[Copy]:
    """The copies that fill ``rank``'s shard under ``new`` from a checkpoint saved under ``saved``.

    Both layouts must describe the same parameters (same count and sizes). Every element of the new shard
    that belongs to a parameter is covered exactly once; padding is not.
    """
    sources = saved_pieces(saved)
    copies = []
    for target_number, piece in enumerate(new.pieces(rank)):
        for start, end, source_rank, file_offset, source_number in sources[piece.param_index]:
            common = overlap(start, end, piece.param_start, piece.param_end)
            if common:
                low, high = common
                copies.append(Copy(source_rank, file_offset + low - start, piece.bucket_index,
                                   piece.shard_offset + low - piece.param_start, high - low, source_number,
                                   low - start, target_number, low - piece.param_start))
    return copies
