"""Usage and cost: what a job will cost before it runs (estimate) and what it cost (report), priced
(pricing) and rendered (render, html), counted with the output's usage totals (outputs/totals)."""
