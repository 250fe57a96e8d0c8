def is_prime(n):
    """Return True if the integer n is a prime number."""
    if n < 1:
        return False
    k = 2
    while k * k <= n:
        if n % k == 0:
            return False
        k += 1
    return True
