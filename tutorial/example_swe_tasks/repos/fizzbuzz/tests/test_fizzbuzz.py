from fizzbuzz import fizzbuzz

def test_fizz():
    assert fizzbuzz(9) == "Fizz"
