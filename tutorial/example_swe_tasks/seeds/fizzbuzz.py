def fizzbuzz(n):
    """Return "Fizz" for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for both, else str(n)."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
