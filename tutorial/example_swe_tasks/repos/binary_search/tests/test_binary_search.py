from binary_search import binary_search

def test_found():
    assert binary_search([1, 3, 5, 7, 9], 7) == 3
