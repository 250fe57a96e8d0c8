def factorial(n):
    """Return n! for an integer n >= 0 (factorial(0) == 1)."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
