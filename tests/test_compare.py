"""manylora.compare: GLiNER2 results equal up to the scores' tolerance, near-ties in either order."""

from manylora.compare import result_differences


def _money(*items):
    return {"entities": {"money": [{"text": t, "confidence": c} for t, c in items]}}


def test_equal_results_and_a_score_within_the_tolerance():
    expected = _money(("$5", 0.9), ("$7", 0.61234))
    assert result_differences(_money(("$5", 0.9), ("$7", 0.61234)), expected) == []
    assert result_differences(_money(("$5", 0.90005), ("$7", 0.61234)), expected) == []
    assert result_differences(_money(("$5", 0.9002), ("$7", 0.61234)), expected) == [
        "$.entities.money[0].confidence: 0.9002 != 0.9 (tolerance 0.0001)"
    ]


def test_near_ties_may_come_in_either_order():
    expected = _money(("$5", 0.9), ("a", 0.61236), ("b", 0.61234), ("$2", 0.3))
    assert result_differences(_money(("$5", 0.9), ("b", 0.61234), ("a", 0.61236), ("$2", 0.3)), expected) == []


def test_other_reorderings_and_other_items_still_differ():
    expected = _money(("$5", 0.9), ("a", 0.61236), ("b", 0.61234))
    swapped_apart = _money(("a", 0.61236), ("$5", 0.9), ("b", 0.61234))  # 0.9 and 0.61 are no tie
    assert result_differences(swapped_apart, expected)
    other_text = _money(("$5", 0.9), ("b", 0.61234), ("c", 0.61236))
    assert result_differences(other_text, expected)
    # lists without confidences keep their order
    assert result_differences({"people": ["Ada", "Bob"]}, {"people": ["Bob", "Ada"]})
