def digit_sum(n):
    """Return the sum of the decimal digits of the integer n (the sign is ignored)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
