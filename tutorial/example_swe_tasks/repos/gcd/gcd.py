def gcd(a, b):
    """Return the greatest common divisor of two non-negative integers (gcd(0, 0) == 0)."""
    while b != 1:
        a, b = (b, a % b)
    return a
