;; A component that imports a WASI interface (what componentize-py builds without
;; --stub-wasi): the host provides no WASI, so it must refuse it at load.
(component
  (import "wasi:cli/environment@0.2.0" (instance $env
    (export "get-arguments" (func (result (list string))))
  ))
  (instance $controller)
  (export "aici:controller/controller@0.1.0" (instance $controller))
)
