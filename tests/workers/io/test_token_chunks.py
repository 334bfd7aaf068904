"""workers/io/local_worker.py's ``token_chunks``: an inference-stage worker's split of a micro-batch
into forwards of at most ``inference.micro_batch_tokens`` padded tokens."""
from workers.io.local_worker import forward_in_chunks, token_chunks


def test_a_micro_batch_within_the_cap_is_one_forward():
    assert token_chunks([3, 5, 4], 15) == [[0, 1, 2]]  # 3 rows x 5 wide = 15


def test_chunks_are_consecutive_and_their_padded_size_stays_within_the_cap():
    # [3, 5] pads to 2 x 5 = 10, adding 4 would make 3 x 5 = 15 > 12; [4, 2] is 2 x 4 = 8, adding 6 would
    # make 3 x 6 = 18; [6, 1] is 2 x 6 = 12
    chunks = token_chunks([3, 5, 4, 2, 6, 1], 12)
    assert chunks == [[0, 1], [2, 3], [4, 5]]
    lengths = [3, 5, 4, 2, 6, 1]
    assert all(len(c) * max(lengths[i] for i in c) <= 12 for c in chunks)
    assert [i for c in chunks for i in c] == list(range(6))


def test_a_sequence_longer_than_the_cap_goes_alone():
    assert token_chunks([2, 40, 2, 2], 16) == [[0], [1], [2, 3]]
    assert token_chunks([], 16) == []


def test_forward_in_chunks_calls_each_chunk_once_and_keeps_the_items_order():
    calls = []
    out = forward_in_chunks(["a", "bb", "ccc", "d"], [1, 2, 3, 1], 4, lambda chunk: calls.append(chunk) or
                            [x.upper() for x in chunk])
    assert out == ["A", "BB", "CCC", "D"]
    assert calls == [["a", "bb"], ["ccc"], ["d"]]  # 2 x 2 = 4; ccc with them 3 x 3 = 9, d with ccc 2 x 3 = 6
