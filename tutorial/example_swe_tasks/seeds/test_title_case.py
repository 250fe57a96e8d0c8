from title_case import title_case


def test_basic():
    assert title_case("hello world") == "Hello World"


def test_shouting():
    assert title_case("LOUD NOISES") == "Loud Noises"


def test_single():
    assert title_case("a") == "A"
