"""plait's training service: ``plait serve`` (gRPC) and its client ``plait jobs``.

A data scientist submits a job (entry point, dataset, parameters with
``PARALLEL_INSTANCES=N``, framework); the service queues it in a SQLite store,
starts it when N workers fit, gives every process the variables its framework
needs to form the group (:mod:`plait.service.contract`), and records state,
exit codes per rank and the progress rank 0 reports with
:func:`plait.progress.report`.

Modules: :mod:`~plait.service.spec` (validation), :mod:`~plait.service.store`
(SQLite), :mod:`~plait.service.contract` and :mod:`~plait.service.bootstrap`
(the per-rank contract), :mod:`~plait.service.hosts` (the hosts backend),
:mod:`~plait.service.kubernetes` (the Kubernetes backend: manifests, with
:mod:`~plait.service.kubeapi` its API calls, :mod:`~plait.service.kubewatch` its job handle,
:mod:`~plait.service.kubecapacity` the cluster's capacity, :mod:`~plait.service.kubeflow` the
PyTorchJob/TFJob objects),
:mod:`~plait.service.core` (queue, scheduler, runners) and, importing grpc,
:mod:`~plait.service.server` and :mod:`~plait.service.client`.
This package imports nothing on import; ``import plait`` does not import it.
"""

__all__: list[str] = []
