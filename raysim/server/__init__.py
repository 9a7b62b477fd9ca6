"""The server-side building blocks algorithms share: aggregation and the server optimizer,
clustering, rebalancing, normality tests. Plain numpy/torch/scikit-learn, no privacy mode: a
mode's view (``raysim.privacy.view``) decides what reaches them."""
