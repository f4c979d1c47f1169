"""A horizontal bar chart of time ratios, written as a self-contained SVG (no plotting library).

Each case is a group of bars, one per reference ("comm / mmengine", ...); a dashed line marks
1.0x (as fast as the reference), and bars left of it mean comm is faster.
"""

from __future__ import annotations

from html import escape

# Colour-blind-safe colours (Okabe-Ito), one per reference, in the legend's order.
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7"]


def ratio_chart(
    title: str, cases: list[tuple[str, dict[str, float]]], references: list[str]
) -> str:
    """Return an SVG chart of ``cases``: (label, {reference: comm time / reference time})."""
    bar, gap, label_width, plot_width = 14, 12, 330, 380
    top = 56
    group = bar * len(references) + gap
    height = top + group * len(cases) + 40
    width = label_width + plot_width + 70
    largest = max([1.0, *(r for _, ratios in cases for r in ratios.values())])
    scale = plot_width / (largest * 1.05)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for index, reference in enumerate(references):
        x = 10 + index * 170
        parts.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{COLOURS[index]}"/>')
        parts.append(f'<text x="{x + 16}" y="42">comm / {escape(reference)}</text>')
    for row, (label, ratios) in enumerate(cases):
        y0 = top + row * group
        parts.append(
            f'<text x="{label_width - 8}" y="{y0 + group / 2}" text-anchor="end">'
            f"{escape(label)}</text>"
        )
        for index, reference in enumerate(references):
            if reference not in ratios:
                continue
            value = ratios[reference]
            y = y0 + index * bar
            parts.append(
                f'<rect x="{label_width}" y="{y}" width="{value * scale:.1f}" '
                f'height="{bar - 2}" fill="{COLOURS[index]}"/>'
            )
            parts.append(
                f'<text x="{label_width + value * scale + 4:.1f}" y="{y + bar - 4}" '
                f'font-size="10">{value:.2f}x</text>'
            )
    one = label_width + scale
    bottom = top + group * len(cases)
    parts.append(
        f'<line x1="{one:.1f}" y1="{top - 4}" x2="{one:.1f}" y2="{bottom}" stroke="black" '
        'stroke-dasharray="4,3"/>'
    )
    parts.append(
        f'<text x="{one:.1f}" y="{bottom + 16}" text-anchor="middle">1.0x (as fast)</text>'
    )
    parts.append(
        f'<text x="{label_width}" y="{bottom + 32}" font-size="11">'
        "shorter is faster: comm's time divided by the reference's</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
