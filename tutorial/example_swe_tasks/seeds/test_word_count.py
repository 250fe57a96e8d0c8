from word_count import word_count


def test_repeat():
    assert word_count("the cat the hat") == {"the": 2, "cat": 1, "hat": 1}


def test_case():
    assert word_count("Go go GO") == {"go": 3}


def test_empty():
    assert word_count("") == {}
