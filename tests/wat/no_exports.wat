;; A valid component that exports nothing.
(component)
