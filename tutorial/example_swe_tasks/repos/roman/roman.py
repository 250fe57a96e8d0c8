def to_roman(n):
    """Return the Roman numeral of an integer 1 <= n <= 3999."""
    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (3, 'IV'), (1, 'I')]
    out = ''
    for value, letters in table:
        while n >= value:
            out += letters
            n -= value
    return out
