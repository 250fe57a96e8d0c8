def celsius_to_fahrenheit(c):
    """Return the temperature c (degrees Celsius) in degrees Fahrenheit: c * 9 / 5 + 32."""
    return c * 9 / 5 + 32
