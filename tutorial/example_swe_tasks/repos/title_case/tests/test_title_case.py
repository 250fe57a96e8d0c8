from title_case import title_case

def test_basic():
    assert title_case("hello world") == "Hello World"

def test_shouting():
    assert title_case("LOUD NOISES") == "Loud Noises"
