def caesar(text, shift):
    """Shift each ASCII letter of text by shift places in the alphabet (wrapping), keeping case; others stay."""
    out = []
    for ch in text:
        if 'a' < ch <= 'z':
            out.append(chr((ord(ch) - ord('a') + shift) % 26 + ord('a')))
        elif 'A' <= ch <= 'Z':
            out.append(chr((ord(ch) - ord('A') + shift) % 26 + ord('A')))
        else:
            out.append(ch)
    return ''.join(out)
