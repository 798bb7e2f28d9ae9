"""Named PromQL templates of each dashboard, apart from the layout that places them."""
