"""The TargetEngine gRPC servicer: protobuf in, engine call, protobuf out. Nothing else."""

from tandem import codec
from tandem.v1 import engine_pb2, engine_pb2_grpc
from target_service.engine import TargetEngine


class TargetServicer(engine_pb2_grpc.TargetEngineServicer):
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def Info(self, request, context):
        return codec.info_to_pb(self.engine.info())

    def Step(self, request, context):
        result = self.engine.step(codec.step_request_from_pb(request))
        return codec.step_result_to_pb(result)

    def Stats(self, request, context):
        return codec.stats_to_pb(self.engine.stats())

    def Reset(self, request, context):
        return codec.stats_to_pb(self.engine.reset())


SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["TargetEngine"].full_name
