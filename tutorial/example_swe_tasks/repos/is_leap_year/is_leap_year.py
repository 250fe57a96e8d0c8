def is_leap_year(year):
    """Return True for a Gregorian leap year: divisible by 4, except centuries not divisible by 400."""
    if year % 400 != 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
