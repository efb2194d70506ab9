;; A component that exports the controller interface of another contract version
;; (0.2.0): the host must refuse it at load and name what it found.
(component
  (instance $controller)
  (export "aici:controller/controller@0.2.0" (instance $controller))
)
