from datetime import timedelta

from django import template

register = template.Library()


@register.filter
def duration(value: timedelta | None) -> str:
    """timedelta -> '1h 02m', '3m 12s', '45s'."""
    if value is None:
        return "–"
    seconds = max(int(value.total_seconds()), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"


@register.filter
def metric(value) -> str:
    """A metric value to four significant digits ('–' when absent)."""
    if value is None:
        return "–"
    return f"{value:.4g}"


@register.simple_tag(takes_context=True)
def sort_link(context, column: str, descending_first: bool = False) -> str:
    """The runs list URL sorted by column (toggling if it is the current sort), keeping the filters."""
    request, current = context["request"], context["sort"]
    if current == column:
        sort = f"-{column}"
    elif current == f"-{column}":
        sort = column
    else:
        sort = f"-{column}" if descending_first else column
    query = request.GET.copy()
    query["sort"] = sort
    query.pop("page", None)
    return f"?{query.urlencode()}"


@register.simple_tag(takes_context=True)
def aria_sort(context, column: str) -> str:
    current = context["sort"]
    return "ascending" if current == column else "descending" if current == f"-{column}" else "none"
